"""Data parallelism: contiguous gradient buffers, bucketed all-reduce overlapped with backward.

Every trainable parameter's `.grad` is a view into one float32 buffer, split into buckets of
about `bucket_size` elements in reverse registration order (roughly the order backward
produces gradients). On the last microbatch of a step, a bucket's all-reduce over the
data-parallel group starts as soon as the last of its gradients is accumulated (a
post-accumulate-grad hook), so communication overlaps the rest of backward (as PyTorch DDP,
Li et al. 2020, sec. 3.2.3, and Megatron's --overlap-grad-reduce). Earlier microbatches only
accumulate (`no_sync`).

Gradients are SUMMED over data-parallel ranks: the training loss is already divided by the
number of tokens of the whole global batch, so the sum is the exact global mean.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class _Bucket:
    start: int
    end: int
    params: list[nn.Parameter]
    ready: int = 0
    handle: object | None = None


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
        with ddp.no_sync() if i < last else contextlib.nullcontext():
            loss(mb).backward()
    ddp.finish_grad_sync()   # waits for (and launches any leftover) bucket all-reduces
    ```
    """

    def __init__(self, module: nn.Module, *, data_parallel_group=None,
                 bucket_size: int = 40_000_000, overlap_grad_reduce: bool = True):
        super().__init__()
        self.module = module
        self.group = data_parallel_group
        self.dp_size = dist.get_world_size(data_parallel_group) if dist.is_initialized() else 1
        self.overlap_grad_reduce = overlap_grad_reduce and self.dp_size > 1
        self.sync_enabled = True
        params = [p for p in module.parameters() if p.requires_grad]
        total = sum(p.numel() for p in params)
        device = params[0].device if params else torch.device("cpu")
        self.buffer = GradBuffer(torch.zeros(total, dtype=torch.float32, device=device))
        offset, bucket_start, bucket_params = 0, 0, []
        for p in reversed(params):
            p.main_grad = self.buffer.data[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
            bucket_params.append(p)
            if offset - bucket_start >= bucket_size:
                self.buffer.buckets.append(_Bucket(bucket_start, offset, bucket_params))
                bucket_start, bucket_params = offset, []
        if bucket_params:
            self.buffer.buckets.append(_Bucket(bucket_start, offset, bucket_params))
        self._bucket_of = {id(p): b for b in self.buffer.buckets for p in b.params}
        self.params = params
        for p in params:
            if p.dtype != torch.float32:
                raise TypeError(f"gradient buffer expects float32 parameters, got {p.dtype}")
            p.grad = p.main_grad
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ------------------------------------------------------------------ hooks and sync
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if param.grad is not None and param.grad.data_ptr() != param.main_grad.data_ptr():
            # autograd replaced our view (should not happen with in-place accumulation)
            param.main_grad.add_(param.grad)
            param.grad = param.main_grad
        if not (self.sync_enabled and self.overlap_grad_reduce):
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.handle is None and self.dp_size > 1:
            bucket.handle = dist.all_reduce(self.buffer.data[bucket.start: bucket.end],
                                            group=self.group, async_op=True)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without communication (all but the last microbatch)."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def finish_grad_sync(self) -> None:
        """Launch buckets not yet launched and wait for all; grads are then DP-summed."""
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
            if p.grad is None or p.grad.data_ptr() != p.main_grad.data_ptr():
                p.grad = p.main_grad
        for bucket in self.buffer.buckets:
            bucket.ready, bucket.handle = 0, None


def all_reduce_embedding_grads(params) -> None:
    """Sum the gradients of the tied word embedding's two copies (first and last pipeline
    stage) so both take the same update and stay equal (Megatron's embedding group)."""
    import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return
    grads = [p.grad for p in params if getattr(p, "shared_embedding", False) and p.grad is not None]
    group = ps.get_embedding_group()
    if group is None or not grads:
        return
    for g in grads:
        dist.all_reduce(g, group=group)
