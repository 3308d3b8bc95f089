"""Data parallelism: contiguous gradient buffers, bucketed reduction overlapped with backward.

Every trainable parameter has a `main_grad`: a view into one float32 buffer, split into
buckets of about `bucket_size` elements in reverse registration order (roughly the order
backward produces gradients). On the last microbatch of a step, a bucket's collective over
the data-parallel group starts as soon as the last of its gradients is accumulated (a
post-accumulate-grad hook), so communication overlaps the rest of backward (as PyTorch DDP,
Li et al. 2020, sec. 3.2.3, and Megatron's --overlap-grad-reduce). Earlier microbatches only
accumulate (`sync_enabled = False`, set by the schedules).

Two modes of the same buffer:

- all-reduce (default): every DP rank ends with the whole DP-summed gradient.
- reduce-scatter (`use_distributed_optimizer`, ZeRO stage 1, Rajbhandari et al. 2020,
  sec. 5.1): each bucket is padded to a multiple of dp and split into dp equal contiguous
  shards; rank r ends with the DP sum of shard r only (`shard_range`). The parameters also
  live in one contiguous buffer of the same layout (`param_buffer`), so after the optimizer
  updates its shard, `start_param_sync` all-gathers each bucket in place; a forward pre-hook on
  each module waits for the buckets of its parameters, so the all-gather overlaps the next
  forward. A tied embedding's copy on the first or last pipeline stage gets a bucket of its
  own, so both copies are sharded identically and their gradient all-reduce (across stages)
  can run on the reduced shard after the reduce-scatter (as Megatron-core does).

Mixed precision (Megatron's accumulate_allreduce_grads_in_fp32): float32 parameters use
`main_grad` as their `.grad` (autograd accumulates in place); bf16/fp16 parameters get their
`.grad` added into the float32 `main_grad` by the hook, which then frees `.grad`.

Gradients are SUMMED over data-parallel ranks: the training loss is already divided by the
number of tokens of the whole global batch, so the sum is the exact global mean.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from parallel_state import collectives
from parallel_state.collectives import all_gather_single, reduce_scatter_single


@dataclass
class _Bucket:
    start: int
    end: int  # padded end (end - start is a multiple of dp when sharding)
    params: list[nn.Parameter]
    ready: int = 0
    handle: object | None = None
    gather: object | None = None  # in-flight parameter all-gather


@dataclass
class GradBuffer:
    """One flat float32 gradient buffer and its buckets."""

    data: torch.Tensor
    buckets: list[_Bucket] = field(default_factory=list)


class DistributedDataParallel(nn.Module):
    """Wrap `module`; `forward` is the module's. Call, per training step:

    ```
    ddp.zero_grad_buffer()
    for i, mb in enumerate(microbatches):
        ddp.sync_enabled = i == last   # buckets reduce during the last backward only
        loss(mb).backward()
    ddp.finish_grad_sync()   # waits for (and launches any leftover) bucket reductions
    ```

    Args:
        use_distributed_optimizer: reduce-scatter instead of all-reduce, buckets padded to a
            multiple of dp, parameters moved into `param_buffer` (see module docstring).
    Attributes:
        offsets: `{id(param): start}` of each parameter in the buffers (flat elements).
    """

    def __init__(self, module: nn.Module, *, data_parallel_group=None,
                 bucket_size: int = 40_000_000, overlap_grad_reduce: bool = True,
                 use_distributed_optimizer: bool = False):
        super().__init__()
        self.module = module
        self.group = data_parallel_group
        self.dp_size = dist.get_world_size(data_parallel_group) if dist.is_initialized() else 1
        self.dp_rank = dist.get_rank(data_parallel_group) if dist.is_initialized() else 0
        self.overlap_grad_reduce = overlap_grad_reduce and self.dp_size > 1
        self.use_distributed_optimizer = use_distributed_optimizer
        self.sync_enabled = True
        params = [p for p in module.parameters() if p.requires_grad]
        if len({p.dtype for p in params}) > 1:
            raise TypeError(f"parameters of one model chunk must share a dtype, got "
                            f"{sorted({str(p.dtype) for p in params})}")
        pad = self.dp_size if use_distributed_optimizer else 1
        buckets, self.offsets = self._layout(params, bucket_size, pad)
        total = buckets[-1].end if buckets else 0
        device = params[0].device if params else torch.device("cpu")
        self.buffer = GradBuffer(torch.zeros(total, dtype=torch.float32, device=device), buckets)
        self.param_buffer = None
        if use_distributed_optimizer and params:
            self.param_buffer = torch.zeros(total, dtype=params[0].dtype, device=device)
            with torch.no_grad():
                for p in params:
                    view = self._view(self.param_buffer, p)
                    view.copy_(p)
                    p.data = view
        self._bucket_of = {id(p): b for b in self.buffer.buckets for p in b.params}
        self.params = params
        for p in params:
            p.main_grad = self._view(self.buffer.data, p)
            p.grad = p.main_grad if p.dtype == torch.float32 else None
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        if self.param_buffer is not None and self.dp_size > 1:
            for m in module.modules():
                own = [p for p in m._parameters.values() if p is not None and id(p) in self.offsets]
                if own:
                    m.register_forward_pre_hook(self._make_param_wait(own))

    @staticmethod
    def _layout(params, bucket_size: int, pad: int):
        """Buckets in reverse registration order; a shared (tied) embedding alone in its own
        bucket when sharding; each bucket padded to a multiple of `pad` elements."""
        buckets, offsets, offset, start, current = [], {}, 0, 0, []

        def close():
            nonlocal offset, start, current
            if current:
                offset = start + -(-(offset - start) // pad) * pad
                buckets.append(_Bucket(start, offset, current))
            start, current = offset, []

        for p in reversed(params):
            alone = pad > 1 and getattr(p, "shared_embedding", False)
            if alone:
                close()
            offsets[id(p)] = offset
            offset += p.numel()
            current.append(p)
            if alone or offset - start >= bucket_size:
                close()
        close()
        return buckets, offsets

    def _view(self, flat: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
        start = self.offsets[id(p)]
        return flat[start: start + p.numel()].view_as(p)

    def shard_range(self, bucket: _Bucket) -> tuple[int, int]:
        """[lo, hi) of the buffer this DP rank owns in `bucket` (all of it unless sharding)."""
        if not self.use_distributed_optimizer:
            return bucket.start, bucket.end
        size = (bucket.end - bucket.start) // self.dp_size
        lo = bucket.start + self.dp_rank * size
        return lo, lo + size

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ------------------------------------------------------------------ hooks and sync
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if param.grad is not None and param.grad.data_ptr() != param.main_grad.data_ptr():
            # bf16/fp16 weights: accumulate in fp32 and free the low-precision grad (also
            # repairs a float32 .grad that autograd replaced instead of accumulating into)
            param.main_grad.add_(param.grad)
            param.grad = param.main_grad if param.dtype == torch.float32 else None
        if not (self.sync_enabled and self.overlap_grad_reduce):
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.handle is not None or self.dp_size == 1:
            return
        data = self.buffer.data[bucket.start: bucket.end]
        if self.use_distributed_optimizer:
            lo, hi = self.shard_range(bucket)
            bucket.handle = reduce_scatter_single(self.buffer.data[lo:hi], data,
                                                  group=self.group, async_op=True)
        else:
            bucket.handle = collectives.all_reduce(data, group=self.group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Launch buckets not yet launched and wait for all; grads are then DP-summed (only
        on `shard_range` when sharding)."""
        for bucket in self.buffer.buckets:
            self._launch(bucket)
        for bucket in self.buffer.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.handle, bucket.ready = None, 0

    def zero_grad_buffer(self) -> None:
        """Zero all gradients (in place) and re-attach `.grad` views the optimizer may have dropped."""
        self.buffer.data.zero_()
        for p in self.params:
            if p.dtype != torch.float32:
                p.grad = None
            elif p.grad is None or p.grad.data_ptr() != p.main_grad.data_ptr():
                p.grad = p.main_grad
        for bucket in self.buffer.buckets:
            bucket.ready, bucket.handle = 0, None

    # ------------------------------------------------------------------ parameter all-gather
    def start_param_sync(self) -> None:
        """All-gather every bucket of `param_buffer` over DP (async, in place), after each rank
        wrote its updated shard. Buckets go in forward order (the last bucket holds the first
        layers); forward pre-hooks wait for the ones a module needs."""
        if self.param_buffer is None or self.dp_size == 1:
            return
        for bucket in reversed(self.buffer.buckets):
            lo, hi = self.shard_range(bucket)
            bucket.gather = all_gather_single(self.param_buffer[bucket.start: bucket.end],
                                              self.param_buffer[lo:hi], group=self.group,
                                              async_op=self.overlap_grad_reduce)

    def _make_param_wait(self, params):
        buckets = list({id(b): b for b in (self._bucket_of[id(p)] for p in params)}.values())

        def hook(module, args):
            for b in buckets:
                if b.gather is not None:
                    b.gather.wait()
                    b.gather = None
        return hook

    def finish_param_sync(self) -> None:
        """Wait for all in-flight parameter all-gathers (before reading weights outside forward)."""
        for bucket in self.buffer.buckets:
            if bucket.gather is not None:
                bucket.gather.wait()
                bucket.gather = None


def param_grad(p: nn.Parameter) -> torch.Tensor | None:
    """The float32 accumulated gradient of `p`: its `main_grad` under DDP, else `.grad`."""
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad


def all_reduce_embedding_grads(params) -> None:
    """Sum the gradients of the tied word embedding's two copies (first and last pipeline
    stage) so both take the same update and stay equal (Megatron's embedding group). With the
    distributed optimizer both copies sit alone in identically sharded buckets, so the sum is
    right on each rank's reduced shard (the rest of the buffer is not read)."""
    import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return
    grads = [param_grad(p) for p in params if getattr(p, "shared_embedding", False)]
    grads = [g for g in grads if g is not None]
    group = ps.get_embedding_group()
    if group is None or not grads:
        return
    for g in grads:
        collectives.all_reduce(g, group=group)
