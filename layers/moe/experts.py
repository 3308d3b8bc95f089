"""The routed experts: `num_local_experts` MLPs whose weights are stacked `[experts, ...]`
tensors, each run on its contiguous slice of the permuted tokens.

An expert is the dense MLP (layers/mlp.py: GeLU, ReLU, or SwiGLU / GeGLU / gpt-oss's
quick_geglu with `[gate; up]` fused in fc1), with biases `[experts, out]` when the config
has `add_bias_linear` (gpt-oss), else without. Its fc1 is split by output columns and its
fc2 by input rows over the expert-tensor-parallel ranks (the TP ranks, or none: expert TP 1
keeps each expert whole), as in the dense MLP, so a TP rank computes a partial sum of every
expert output (or whole outputs of its own experts) and the MoE layer reduces once, after
combining (layers/moe/moe_layer.py).

`GroupedLinear` loops over the experts (never over tokens): one GEMM per expert forward and
two backward, the weight gradient of all experts written into one stacked tensor (autograd
through per-expert views would allocate a full-size gradient per expert). An expert with no
tokens costs nothing and gets a zero gradient, so every expert weight has a gradient every
step whatever the routing (a missing gradient would stall a bucketed gradient sync). Inside a
zero-bubble B pass the weight gradient is deferred to W (parallel_state/weight_grads.py).
`torch._grouped_mm` is not used: on CPU in float32 the loop's oneDNN GEMMs are the faster
path (layers/gemm.py) and they give every layout the same per-expert products.
"""
from __future__ import annotations

import torch
from torch import nn

from parallel_state import get_expert_tensor_parallel_world_size, weight_grads

from .. import gemm
from ..mlp import GATED, activate, gate_args
from ..quant import QuantizedWeight
from ..sharding import set_tensor_parallel_attributes


def _spans(counts: list[int]) -> list[tuple[int, int, int]]:
    """`(expert, start, stop)` row ranges of the non-empty experts."""
    out, start = [], 0
    for e, n in enumerate(counts):
        if n:
            out.append((e, start, start + n))
        start += n
    return out


def _mm_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b^T`: oneDNN on CPU float32 (layers/gemm.py), else torch; a low-bit expert
    weight (layers/quantized.py `QuantizedExperts`) through `QuantizedWeight.linear`."""
    if isinstance(b, QuantizedWeight):
        return b.linear(a)
    return gemm.linear_nt(a, b) if gemm.uses_onednn(a, b) else a @ b.t()


class _GroupedLinear(torch.autograd.Function):
    """`y[rows of e] = x[rows of e] @ weight[e]^T` for the experts' consecutive row blocks."""

    @staticmethod
    def forward(ctx, x, weight, counts):
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.weight = counts, weight  # the leaf a deferred W accumulates into
        return _grouped_forward(x, weight, counts)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        spans = _spans(ctx.counts)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.empty_like(x)
            for e, lo, hi in spans:  # dX = dY W
                grad_x[lo:hi] = _mm_nt(grad[lo:hi], weight[e].t())
        if ctx.needs_input_grad[1] and not weight_grads.defer(
                lambda: (_weight_grad(x, grad, weight, spans),), [ctx.weight]):
            grad_w = _weight_grad(x, grad, weight, spans)  # else a zero-bubble W computes it
        return grad_x, grad_w, None


def _weight_grad(x, grad, weight, spans) -> torch.Tensor:
    """`dW[e] = dY[rows of e]^T X[rows of e]`, zero for experts without rows."""
    grad_w = torch.zeros_like(weight)
    for e, lo, hi in spans:
        g, xe = grad[lo:hi], x[lo:hi]
        grad_w[e] = gemm.weight_grad(g, xe) if gemm.uses_onednn(g, xe) else g.t() @ xe
    return grad_w


def _grouped_forward(x, weight, counts):
    y = x.new_empty(x.shape[0], weight.shape[1])
    for e, lo, hi in _spans(counts):
        y[lo:hi] = _mm_nt(x[lo:hi], weight[e])
    return y


class GroupedLinear(nn.Module):
    """`num_local_experts` bias-free linear maps, weight `[experts, out, in]` (per expert
    nn.Linear's `[out, in]`); `forward(x [N, in], counts)` with `counts[e]` consecutive rows
    for expert e (sum N) -> `[N, out]`. `partition_dim` 1 splits `out` over expert TP (fc1,
    with `num_fused_parts` blocks split separately), 2 splits `in` (fc2). Tagged
    `expert_parallel`: dim 0 holds this rank's slice of the layer's experts. For inference
    the weight may be a `QuantizedExperts` (layers/quantized.py), one low-bit weight per
    expert."""

    def __init__(self, num_local_experts: int, input_size: int, output_size: int, *,
                 partition_dim: int, init: str, num_fused_parts: int = 1, bias: bool = False):
        super().__init__()
        etp = get_expert_tensor_parallel_world_size()
        shape = [num_local_experts, output_size, input_size]
        if shape[partition_dim] % etp:
            raise ValueError(f"expert size {shape[partition_dim]} is not divisible by "
                             f"expert-tensor-parallel-size {etp}")
        shape[partition_dim] //= etp
        self.weight = nn.Parameter(torch.empty(shape))
        set_tensor_parallel_attributes(self.weight, partition_dim=partition_dim, init=init,
                                       num_fused_parts=num_fused_parts)
        self.weight.expert_parallel = True
        self.bias, self.bias_share = None, 1.0
        if bias:  # [experts, out]: split with the weight's out (fc1), whole beside its in (fc2)
            self.bias = nn.Parameter(torch.empty(num_local_experts, shape[1]))
            set_tensor_parallel_attributes(self.bias, partition_dim=1 if partition_dim == 1
                                           else None, init="zeros",
                                           num_fused_parts=num_fused_parts)
            self.bias.expert_parallel = True
            # fc2's outputs are partial sums over expert TP: each rank adds 1/etp of the bias
            self.bias_share = 1.0 / etp if partition_dim == 2 else 1.0

    def _add_bias(self, y: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`y [N, out]` plus each row's expert bias; under expert TP, fc2's share `b / etp`
        whose gradient is that of the whole `b` (the partial sums add up to `b`; each rank's
        gradient of the summed output is the whole output's)."""
        bias = self.bias
        if self.bias_share != 1.0:
            bias = bias - bias.detach() * (1.0 - self.bias_share)
        index = torch.repeat_interleave(torch.arange(len(counts), device=y.device),
                                        torch.tensor(counts, device=y.device),
                                        output_size=y.shape[0])
        return y + bias.index_select(0, index).to(y.dtype)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if len(counts) != self.weight.shape[0] or sum(counts) != x.shape[0]:
            raise ValueError(f"counts {counts} do not split {x.shape[0]} rows over "
                             f"{self.weight.shape[0]} experts")
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            y = _GroupedLinear.apply(x, self.weight, tuple(counts))
        else:
            y = _grouped_forward(x, self.weight, counts)
        return y if self.bias is None else self._add_bias(y, counts)


class Experts(nn.Module):
    """`num_local_experts` MLPs: `forward(x [N, h], counts)` -> `[N, h]`, partial sums over
    TP (the caller reduces). Activation and sizes from the config (`activation`,
    `moe_ffn_hidden_size`)."""

    def __init__(self, config, num_local_experts: int):
        super().__init__()
        self.activation = config.activation
        self.gate_args = gate_args(config)
        gated = self.activation in GATED
        ffn, h = config.moe_ffn_hidden_size, config.hidden_size
        self.num_local_experts = num_local_experts
        bias = bool(config.add_bias_linear)
        self.linear_fc1 = GroupedLinear(num_local_experts, h, ffn * (2 if gated else 1),
                                        partition_dim=1, init="normal",
                                        num_fused_parts=2 if gated else 1, bias=bias)
        self.linear_fc2 = GroupedLinear(num_local_experts, ffn, h, partition_dim=2,
                                        init="scaled_normal", bias=bias)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        y = activate(self.linear_fc1(x, counts), self.activation, *self.gate_args)
        return self.linear_fc2(y, counts)
