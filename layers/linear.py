"""Column- and row-parallel linear layers (Shoeybi et al. 2019, sec. 3, Fig. 3).

Y = X A with A split by columns: each rank computes X A_i (ColumnParallelLinear). Y = X A with
A split by rows and X split by columns: each rank computes X_i A_i and the partial sums are
reduced (RowParallelLinear). A column layer followed by a row layer needs one all-reduce in
forward and one in backward. With sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2)
the column layer's input arrives as a sequence shard `[s/tp, b, h]` and is all-gathered, and
the row layer reduce-scatters its output back to a sequence shard.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from parallel_state import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    get_tensor_model_parallel_world_size,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from parallel_state import weight_grads
from parallel_state.mappings import (
    all_gather_sequence,
    all_gather_sequence_async,
    all_reduce_async,
    reduce_scatter_sequence_async,
)

from . import gemm
from .fp8 import fp8_linear
from .quant import QuantizedWeight
from .sharding import set_tensor_parallel_attributes


class _LinearWithGrad(torch.autograd.Function):
    """`Y = X W^T + b` with its own backward, for two reasons (either or both):

    - a column-parallel layer's TP communication overlaps compute (Megatron's async
      tensor-parallel all-reduce; Narayanan et al. 2021, sec. 4.2): the input gradient `dY W`
      is computed first and its all-reduce over TP (`grad_all_reduce`) starts while the weight
      gradient `dY^T X` is computed. With sequence parallelism `X` arrives as the shard
      `[s/tp, b, in]`: forward all-gathers it, backward keeps only the shard (Korthikanti et
      al. 2022, sec. 4.2.2 count the shard, not the gathered input), starts its all-gather
      before computing `dY W`, and starts the input gradient's reduce-scatter before `dY^T X`;
    - on CPU in float32 the three GEMMs go to oneDNN (`onednn`; layers/gemm.py).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, sequence_parallel, grad_all_reduce, onednn):
        # X only serves the weight gradient: a frozen weight (a LoRA base) keeps none
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        ctx.params = (weight, bias)  # leaves whose deferred gradients W accumulates
        ctx.has_bias, ctx.sequence_parallel = bias is not None, sequence_parallel
        ctx.grad_all_reduce, ctx.onednn = grad_all_reduce, onednn
        total = all_gather_sequence(x) if sequence_parallel else x
        if not onednn:
            return F.linear(total, weight, bias)
        return gemm.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_input, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_bias = ctx.has_bias and ctx.needs_input_grad[2]
        if (need_weight or need_bias) and weight_grads.defer(
                functools.partial(_LinearWithGrad._weight_grads, ctx, x, grad, need_weight,
                                  need_bias),
                [t for t, need in zip(ctx.params, (need_weight, need_bias)) if need]):
            need_weight = need_bias = False  # a zero-bubble B: W computes them later
            total, gather = x, None
        else:
            total, gather = all_gather_sequence_async(x) if ctx.sequence_parallel and \
                need_weight else (x, None)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_input = reduce = None
        if need_input:
            if ctx.onednn:
                grad_input = gemm.linear(grad, weight.t())
            else:
                grad_input = grad.matmul(weight)
        if gather is not None:
            gather.wait()
        if need_input and ctx.sequence_parallel:
            grad_input, reduce = reduce_scatter_sequence_async(grad_input)
        elif need_input and ctx.grad_all_reduce:
            reduce = all_reduce_async(grad_input)
        grad_weight = None
        if need_weight:
            grad_weight = _LinearWithGrad._weight_gemm(ctx, grad_2d, total)
        grad_bias = grad_2d.sum(0) if need_bias else None
        if reduce is not None:
            reduce.wait()
        return grad_input, grad_weight, grad_bias, None, None, None

    @staticmethod
    def _weight_grads(ctx, x, grad, need_weight: bool, need_bias: bool) -> tuple:
        """The deferred W of one call: `(dY^T X, sum dY)` for the wanted ones, X gathered
        over the sequence under sequence parallelism (the same GEMM as the joint backward)."""
        grad_2d = grad.reshape(-1, grad.shape[-1])
        out = []
        if need_weight:
            total = all_gather_sequence(x) if ctx.sequence_parallel else x
            out.append(_LinearWithGrad._weight_gemm(ctx, grad_2d, total))
        if need_bias:
            out.append(grad_2d.sum(0))
        return tuple(out)

    @staticmethod
    def _weight_gemm(ctx, grad_2d, total) -> torch.Tensor:
        """`dW = dY^T X` over all tokens: `grad_2d [n, out]`, `total [..., in]` -> `[out, in]`."""
        total_2d = total.reshape(-1, total.shape[-1])
        return gemm.weight_grad(grad_2d, total_2d) if ctx.onednn else grad_2d.t().matmul(total_2d)


class _QuantizedLinear(torch.autograd.Function):
    """`Y = X W^T + b` of a frozen low-bit weight (`QuantizedWeight`) whose input needs a
    gradient (QLoRA: adapters below it train): forward by `QuantizedWeight.linear`, backward
    `dX = dY W` by `QuantizedWeight.input_grad` (slabs of rows; the weight is never
    de-quantized whole) and `db = sum dY` when the bias trains."""

    @staticmethod
    def forward(ctx, x, bias, weight):
        ctx.weight, ctx.has_bias = weight, bias is not None
        return weight.linear(x, bias)

    @staticmethod
    def backward(ctx, grad):
        grad_x = ctx.weight.input_grad(grad) if ctx.needs_input_grad[0] else None
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) \
            if ctx.has_bias and ctx.needs_input_grad[1] else None
        return grad_x, grad_b, None


# Inference on CPU with 2 to this many rows (decode: one token per sequence) computes
# `Y^T = W X^T` instead of `Y = X W^T` where torch's MKL does the GEMM: the same product, but
# MKL streams the large weight as the left operand: a SmolLM2 decode step at batch 8 ran 1.40x
# faster on 2 threads and 1.27x on one (an earlier machine, without bf16 instructions; the
# weights, not the FLOPs, bound decode; docs/DECISIONS.md). oneDNN needs no such turn.
FEW_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: `x [..., in]`, `weight [out, in]` -> `[..., out]`, with
    autograd. On CPU in float32 the GEMM is oneDNN's (forward and backward; layers/gemm.py);
    under no-grad a bf16 / fp16 weight packed by `gemm.pack` is multiplied through its packed
    copy: in its own dtype at any row count where the CPU has the instructions
    (`gemm.native`), else through its float32 copy at 2 rows or more (the input widened, the
    result rounded to its dtype once; one row stays torch's narrow matrix-vector product,
    which reads half the bytes); where the GEMM is MKL's,
    under no-grad with 2..FEW_ROWS rows, it is computed as `(W X^T)^T` (one row: MKL's
    matrix-vector product either way, and `F.linear` measured faster). A low-bit weight
    (`layers.quant.QuantizedWeight`, frozen) multiplies through its own
    `QuantizedWeight.linear`, with a graph to `x` when `x` needs a gradient (QLoRA:
    `_QuantizedLinear`). Under `weight_grads.split_backward()` (zero-bubble schedules)
    a graph is built through `_LinearWithGrad`, whose backward can defer the weight
    gradient."""
    if isinstance(weight, QuantizedWeight):
        if torch.is_grad_enabled() and (x.requires_grad or (
                bias is not None and bias.requires_grad)):
            return _QuantizedLinear.apply(x, bias, weight)
        return weight.linear(x, bias)
    if weight_grads.splitting() and torch.is_grad_enabled() and weight.requires_grad \
            and x.dim() >= 2 and not torch.is_autocast_enabled(x.device.type):
        return _LinearWithGrad.apply(x, weight, bias, False, False, gemm.uses_onednn(x, weight))
    if gemm.uses_onednn(x, weight) and x.dim() >= 2:
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad)):
            return _LinearWithGrad.apply(x, weight, bias, False, False, True)
        return gemm.linear(x, gemm.packed(weight), bias)
    if x.dtype != torch.float32 and x.dtype == weight.dtype and not torch.is_grad_enabled():
        copy = gemm.packed(weight)  # a bf16 / fp16 weight's packed copy, when it has one
        if copy is not weight and x.device.type == "cpu" and x.dim() >= 2 \
                and not torch.is_autocast_enabled("cpu"):
            if copy.dtype == x.dtype:  # packed in its own dtype (gemm.native): any rows
                return gemm.linear(x, copy, bias)
            if x.numel() > x.shape[-1]:  # a float32 copy: 2 rows or more
                y = gemm.linear(x.float(), copy, None if bias is None else bias.float())
                return y.to(x.dtype)  # rounded once, as a bf16 GEMM accumulating in float32
    rows = x.numel() // max(x.shape[-1], 1)
    if torch.is_grad_enabled() or x.device.type != "cpu" or not 1 < rows <= FEW_ROWS \
            or x.dim() < 2:
        return F.linear(x, weight, bias)
    y = torch.mm(weight, x.reshape(rows, -1).t()).t()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def pack_weights(model: nn.Module, extra: tuple[torch.Tensor, ...] = ()) -> int:
    """For inference on CPU (float32, bfloat16, float16): give the weight of every
    ColumnParallelLinear and RowParallelLinear in `model`, and the `extra` weights (a tied
    output layer's, which lives in the embedding), oneDNN's pre-packed copy
    (`layers.gemm.pack`: float32, or bf16 / fp16 where the CPU multiplies those natively),
    which `linear` then reads under no-grad. Nothing happens where the GEMM is not oneDNN's;
    low-bit weights (layers/quantized.py) are left as they are. Returns the bytes the copies
    take."""
    weights = [m.weight for m in model.modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.weight is not None]
    total, seen = 0, set()
    for w in weights + list(extra):
        if id(w) not in seen and isinstance(w, torch.Tensor) and gemm.packable(w):
            seen.add(id(w))
            total += gemm.pack(w)
    return total


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor-model-parallel-size ({d})")
    return n // d


class ColumnParallelLinear(nn.Module):
    """`Y = X A^T + b` with the weight's output dim split over TP ranks.

    Input `[s, b, in]` (or `[s/tp, b, in]` with sequence_parallel); output `[s, b, out/tp]`, or
    `[s, b, out]` with gather_output. `num_fused_parts` > 1 marks a weight made of that many
    blocks stacked on the output dim, each split separately (SwiGLU's [gate; up]).
    `forward(x, weight=...)` uses an external weight (tied output layer). `lora`: LoRA
    adapters whose term is added before the gather (layers/lora.py), or None.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 init: str = "normal", num_fused_parts: int = 1, skip_weight: bool = False,
                 full_rows: int | None = None, params_dtype: torch.dtype = torch.float32):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = _divide(output_size, tp, "output size")
        self.gather_output = gather_output
        self.num_fused_parts = num_fused_parts
        self.sequence_parallel = sequence_parallel and tp > 1
        self.tensor_parallel = tp > 1
        if skip_weight:
            self.weight = None
        else:
            self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size,
                                                   dtype=params_dtype))
            set_tensor_parallel_attributes(self.weight, partition_dim=0, init=init,
                                           num_fused_parts=num_fused_parts, full_rows=full_rows)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_partition, dtype=params_dtype))
            set_tensor_parallel_attributes(self.bias, partition_dim=0, init="zeros",
                                           num_fused_parts=num_fused_parts)
        else:
            self.bias = None
        self.lora = None  # LoRA adapters (layers/lora.py `add_lora`)
        self.fp8 = None  # FP8 GEMMs (layers/fp8.py `apply_fp8`)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        if weight is None:
            raise ValueError("ColumnParallelLinear built with skip_weight needs forward(x, weight)")
        low_bit = isinstance(weight, QuantizedWeight)  # frozen: its own product (`linear`)
        if self.fp8 is not None and not low_bit:  # gathered / copied, then the FP8 GEMMs
            x_in = gather_from_sequence_parallel_region(x) if self.sequence_parallel \
                else copy_to_tensor_model_parallel_region(x)
            y = fp8_linear(x_in, weight, self.bias, self.fp8)
        elif self.sequence_parallel and low_bit:
            y = linear(gather_from_sequence_parallel_region(x), weight, self.bias)
        elif self.sequence_parallel:
            y = _LinearWithGrad.apply(x, weight, self.bias, True, False,
                                      gemm.uses_onednn(x, weight))
        elif self.tensor_parallel and torch.is_grad_enabled() and not low_bit \
                and not torch.is_autocast_enabled(x.device.type):
            y = _LinearWithGrad.apply(x, weight, self.bias, False, True,
                                      gemm.uses_onednn(x, weight))
        else:  # one TP rank, no graph, or autocast (whose casts F.linear's backward knows)
            y = linear(copy_to_tensor_model_parallel_region(x), weight, self.bias)
        if self.lora is not None:
            y = y + self.lora(x, self.sequence_parallel)
        if not self.gather_output:
            return y
        y = gather_from_tensor_model_parallel_region(y)
        tp = get_tensor_model_parallel_world_size()
        if self.num_fused_parts > 1 and tp > 1:  # rank-major [tp, parts, n] -> dense [parts, tp, n]
            y = y.unflatten(-1, (tp, self.num_fused_parts, -1)).transpose(-3, -2).flatten(-3)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size} "
                f"(per rank {self.output_size_per_partition}), sp={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """`Y = X A^T + b` with the weight's input dim split over TP ranks.

    Input `[s, b, in/tp]` (already split, as a column layer leaves it); output `[s, b, out]`
    summed over TP, or `[s/tp, b, out]` reduce-scattered with sequence_parallel. The bias is
    added once, after the reduction (and after the `lora` adapters' term, layers/lora.py).
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True,
                 sequence_parallel: bool = False, init: str = "scaled_normal",
                 params_dtype: torch.dtype = torch.float32):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = _divide(input_size, tp, "input size")
        self.sequence_parallel = sequence_parallel and tp > 1
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition,
                                               dtype=params_dtype))
        set_tensor_parallel_attributes(self.weight, partition_dim=1, init=init)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype))
            set_tensor_parallel_attributes(self.bias, partition_dim=None, init="zeros",
                                           sequence_parallel=self.sequence_parallel)
        else:
            self.bias = None
        self.lora = None  # LoRA adapters (layers/lora.py `add_lora`)
        self.fp8 = None  # FP8 GEMMs (layers/fp8.py `apply_fp8`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight) if self.fp8 is None or isinstance(self.weight, QuantizedWeight) \
            else fp8_linear(x, self.weight, None, self.fp8)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y)
        else:
            y = reduce_from_tensor_model_parallel_region(y)
        if self.lora is not None:
            y = y + self.lora(x, self.sequence_parallel)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in={self.input_size} (per rank {self.input_size_per_partition}), "
                f"out={self.output_size}, sp={self.sequence_parallel}")


class ReplicatedLinear(nn.Module):
    """`Y = X A^T` with the whole weight `[out, in]` on every TP rank (no bias): a small
    projection whose output every rank needs whole (multi-head latent attention's
    down-projections, layers/mla.py). No communication of its own. With `sequence_parallel`
    the input is this rank's shard `[s/tp, b, in]` and so is the output; the weight's
    gradient is then partial (its tokens only) and the weight is tagged `sequence_parallel`,
    so the trainer sums it over TP after backward, like a norm's. Without it, the input is the
    whole `[s, b, in]` on every rank, and whatever consumes the output must all-reduce its
    gradient over TP (a column-parallel layer's input does), so the gradients are complete."""

    def __init__(self, input_size: int, output_size: int, *, sequence_parallel: bool = False,
                 init: str = "normal"):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        set_tensor_parallel_attributes(
            self.weight, partition_dim=None, init=init,
            sequence_parallel=sequence_parallel and get_tensor_model_parallel_world_size() > 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size} (replicated over TP)"
