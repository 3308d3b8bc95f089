"""Collectives with autograd: each forward is paired with its dual in backward.

Names follow the Megatron-LM paper (Shoeybi et al. 2019, sec. 3, the `f` and `g` operators)
and the sequence-parallel paper (Korthikanti et al. 2022, sec. 4.2.2, `g` and `g-bar`):

| function                                   | forward            | backward            |
|--------------------------------------------|--------------------|---------------------|
| copy_to_tensor_model_parallel_region (f)   | identity           | all-reduce          |
| reduce_from_tensor_model_parallel_region(g)| all-reduce         | identity            |
| scatter_to_tensor_model_parallel_region    | split last dim     | all-gather last dim |
| gather_from_tensor_model_parallel_region   | all-gather last dim| split last dim      |
| scatter_to_sequence_parallel_region        | split dim 0        | all-gather dim 0    |
| gather_from_sequence_parallel_region       | all-gather dim 0   | reduce-scatter dim 0|
| reduce_scatter_to_sequence_parallel_region | reduce-scatter dim0| all-gather dim 0    |
| all_to_all (any group, e.g. ep)            | all-to-all dim 0   | same, splits swapped|

All but all_to_all act on the current grid's tensor-parallel group and are identities on one
TP rank. Sequence-parallel tensors are `[s, b, h]` with the sequence (dim 0) split across TP
ranks.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import collectives, grid
from .collectives import all_gather_single, reduce_scatter_single


def _tp() -> tuple[int, int]:
    return grid.get_tensor_model_parallel_world_size(), grid.get_tensor_model_parallel_rank()


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over TP into a new tensor (the caller's tensor is left untouched)."""
    if _tp()[0] == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format)
    collectives.all_reduce(x, group=grid.get_tensor_model_parallel_group())
    return x


def _split_last(x: torch.Tensor) -> torch.Tensor:
    size, rank = _tp()
    if size == 1:
        return x
    if x.shape[-1] % size:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by tensor-parallel size {size}")
    return x.chunk(size, dim=-1)[rank].contiguous()


def _gather_last(x: torch.Tensor) -> torch.Tensor:
    size, _ = _tp()
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    collectives.all_gather(parts, x, group=grid.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _split_first(x: torch.Tensor) -> torch.Tensor:
    size, rank = _tp()
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tensor-parallel "
                         f"size {size}; sequence parallelism needs --seq-length divisible by --tp")
    return x.chunk(size, dim=0)[rank].contiguous()


def _gather_first(x: torch.Tensor) -> torch.Tensor:
    out, handle = all_gather_sequence_async(x)
    if handle is not None:
        handle.wait()
    return out


def _reduce_scatter_first(x: torch.Tensor) -> torch.Tensor:
    out, handle = reduce_scatter_sequence_async(x)
    if handle is not None:
        handle.wait()
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g)


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x)

    @staticmethod
    def backward(ctx, g):
        return g


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_last(x)

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g)


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gather_last(x)

    @staticmethod
    def backward(ctx, g):
        return _split_last(g)


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_first(x)

    @staticmethod
    def backward(ctx, g):
        return _gather_first(g)


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tensor_parallel_output_grad):
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_first(x)

    @staticmethod
    def backward(ctx, g):
        # When the consumer is tensor-parallel (each rank holds a partial gradient of the
        # full sequence) the gradients must be summed; otherwise each rank keeps its slice.
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_first(g), None
        return _split_first(g), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _reduce_scatter_first(x)

    @staticmethod
    def backward(ctx, g):
        return _gather_first(g)


def copy_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """`f`: identity forward, all-reduce of the gradient over TP backward."""
    if not torch.is_grad_enabled():  # no graph (inference): skip the autograd.Function call
        return x
    return _CopyToTP.apply(x)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """`g`: all-reduce over TP forward, identity backward."""
    if not torch.is_grad_enabled():
        return _all_reduce(x)
    return _ReduceFromTP.apply(x)


def sum_over_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """All-reduce over TP forward and backward: a sum of partial terms (each rank's from its
    own shard, e.g. the sum of squares of a norm over a TP-split projection) that every rank
    then uses on its own shard, so each rank's gradient of the sum is partial too."""
    if not torch.is_grad_enabled():
        return _all_reduce(x)
    return _ReduceFromTP.apply(_CopyToTP.apply(x))  # all-reduce forward, then backward


def scatter_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Keep this rank's slice of the last dim; backward all-gathers it."""
    return _ScatterToTP.apply(x)


def gather_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """All-gather the last dim `[..., n/tp] -> [..., n]`; backward keeps this rank's slice."""
    if not torch.is_grad_enabled():
        return _gather_last(x)
    return _GatherFromTP.apply(x)


def scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """`[s, b, h] -> [s/tp, b, h]` (this rank's sequence shard); backward all-gathers."""
    return _ScatterToSP.apply(x)


def gather_from_sequence_parallel_region(x: torch.Tensor,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """`g` of sequence parallelism: `[s/tp, b, h] -> [s, b, h]`; backward reduce-scatters."""
    return _GatherFromSP.apply(x, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """`g-bar`: sum partial `[s, b, h]` over TP and keep `[s/tp, b, h]`; backward all-gathers."""
    return _ReduceScatterToSP.apply(x)


def _all_to_all(x: torch.Tensor, output_split_sizes, input_split_sizes, group) -> torch.Tensor:
    """The exchange of `all_to_all`, splits already checked (`_splits`)."""
    if dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    rows = x.shape[0] if output_split_sizes is None else sum(output_split_sizes)
    out = x.new_empty((rows, *x.shape[1:]))
    collectives.all_to_all_single(out, x, output_split_sizes, input_split_sizes, group=group)
    return out


def _splits(name: str, splits, size: int, rows: int | None = None) -> list[int] | None:
    """`splits` as a list of ints, checked: one non-negative int per rank, summing to `rows`
    (the input's dim 0) when given."""
    if splits is None:
        if rows is not None and rows % size:
            raise ValueError(f"all_to_all without split sizes needs dim 0 ({rows}) divisible "
                             f"by the group size {size}; pass input_split_sizes")
        return None
    if len(splits) != size or any(int(n) != n or n < 0 for n in splits):
        raise ValueError(f"{name} must be {size} non-negative ints (one per rank of the "
                         f"group), got {list(splits)}")
    splits = [int(n) for n in splits]
    if rows is not None and sum(splits) != rows:
        raise ValueError(f"{name} {splits} sum to {sum(splits)}, but the input has {rows} "
                         f"rows (dim 0)")
    return splits


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group):
        ctx.group, ctx.splits = group, (output_split_sizes, input_split_sizes)
        return _all_to_all(x, output_split_sizes, input_split_sizes, group)

    @staticmethod
    def backward(ctx, g):
        output_split_sizes, input_split_sizes = ctx.splits
        return _all_to_all(g, input_split_sizes, output_split_sizes, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_split_sizes: Sequence[int] | None,
               input_split_sizes: Sequence[int] | None, group) -> torch.Tensor:
    """Exchange rows of `x [tokens, ...]` (e.g. `[tokens, h]`) over `group`: rows
    `input_split_sizes[j]` (in order along dim 0) go to rank j, and the result
    `[sum(output_split_sizes), ...]` holds `output_split_sizes[j]` rows from rank j, in rank
    order. Backward is the same exchange of the gradient with the splits swapped. None
    splits: equal parts of dim 0. Any split may be 0 (a rank that sends or receives no
    tokens). The identity on a group of one rank. The token dispatch of a mixture of experts
    (GShard, Lepikhin et al. 2020; Megatron-Core's `tensor_parallel/mappings.py` all_to_all).

    Every rank of `group` calls it, and `output_split_sizes[j]` here must equal rank j's
    `input_split_sizes[this rank]` (exchange the counts first, e.g. with an all-to-all of the
    per-rank counts): torch's backend does not check that.

    Raises:
        ValueError: a split list without one non-negative int per rank of `group`,
            `input_split_sizes` not summing to dim 0 of `x`, or (None splits) dim 0 not
            divisible by the group size.
    """
    size = dist.get_world_size(group)
    input_split_sizes = _splits("input_split_sizes", input_split_sizes, size, x.shape[0])
    output_split_sizes = _splits("output_split_sizes", output_split_sizes, size)
    if not torch.is_grad_enabled():
        return _all_to_all(x, output_split_sizes, input_split_sizes, group)
    return _AllToAll.apply(x, output_split_sizes, input_split_sizes, group)


def all_reduce_sequence_parallel_grads(params) -> None:
    """Sum over TP the gradients of parameters used on sequence shards (norm weights/biases).

    Under sequence parallelism each TP rank sees only its tokens, so the gradient of a
    replicated norm weight is partial; forgetting this sum is the classic SP bug.
    """
    # `main_grad`: the float32 gradient under data_parallel.ddp (bf16 weights free `.grad`)
    grads = [getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None
             else p.grad for p in params if getattr(p, "sequence_parallel", False)]
    all_reduce_over_tensor_parallel([g for g in grads if g is not None])


def all_reduce_over_tensor_parallel(tensors) -> None:
    """Sum each of `tensors` over TP in place, in one flat all-reduce. Every TP rank must pass
    tensors of the same sizes in the same order (e.g. pieces of sharded gradients)."""
    size, _ = _tp()
    if size == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    collectives.all_reduce(flat, group=grid.get_tensor_model_parallel_group())
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()


# Plain (no-autograd) collectives, for layers that write their own backward.
all_gather_sequence = _gather_first


def all_reduce_async(x: torch.Tensor):
    """Start summing `x` over TP in place; returns a handle to `wait()` on (None at tp 1)."""
    if _tp()[0] == 1:
        return None
    return collectives.all_reduce(x, group=grid.get_tensor_model_parallel_group(),
                                  async_op=True)


def all_gather_sequence_async(x: torch.Tensor):
    """Start all-gathering `x [s/tp, ...]` into a new `[s, ...]`; returns `(out, handle)`
    (handle None at tp 1, where out is x). Read `out` only after `handle.wait()`."""
    size, _ = _tp()
    if size == 1:
        return x, None
    x = x.contiguous()
    out = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, all_gather_single(out, x, group=grid.get_tensor_model_parallel_group(),
                                  async_op=True)


def reduce_scatter_sequence_async(x: torch.Tensor):
    """Start summing `x [s, ...]` over TP and keeping this rank's `[s/tp, ...]`; returns
    `(out, handle)` (handle None at tp 1). Read `out` only after `handle.wait()`.

    Raises:
        ValueError: dim 0 not divisible by the TP size.
    """
    size, _ = _tp()
    if size == 1:
        return x, None
    if x.shape[0] % size:
        raise ValueError(f"dim 0 ({x.shape[0]}) is not divisible by tensor-parallel size {size}")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, reduce_scatter_single(out, x, group=grid.get_tensor_model_parallel_group(),
                                      async_op=True)
