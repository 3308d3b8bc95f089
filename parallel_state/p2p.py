"""Point-to-point exchange of activation / gradient tuples between adjacent pipeline stages.

Used by the training schedules and by pipelined inference (it lives here, below both). A
stage may pass several tensors (an encoder-decoder stage sends the encoder output beside the
hidden states), so everything here moves *tuples* whose shapes are known up front (`[s, b, h]`, or `[s/tp, b, h]` under
sequence parallelism; the receiver allocates from the shapes it is given).

Every exchange is one `batch_isend_irecv` holding all sends and receives of a schedule step.
Ordering rule, so that matching is unambiguous on NCCL (which ignores tags) and on gloo (which
matches by tag): a rank posts its forward-direction sends (to next) before its backward-
direction sends (to prev), and its forward-direction receives (from prev) before its backward-
direction receives (from next); forward-direction messages carry tag 0, backward ones tag 1.
With pp = 2 the next and previous ranks are the same peer and the rule still pairs them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import collectives, grid as ps

FORWARD_TAG, BACKWARD_TAG = 0, 1

_timeline = None  # while a profiled schedule runs: an object whose span("C") times an exchange


@contextlib.contextmanager
def recording(timeline):
    """Record every exchange of the enclosed block as a communication span of `timeline`."""
    global _timeline
    previous, _timeline = _timeline, timeline
    try:
        yield
    finally:
        _timeline = previous

Tensors = tuple[torch.Tensor, ...]


@dataclass
class TensorSpec:
    """Shapes and dtype of the tuple a stage exchanges (one entry per tensor)."""

    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    device: torch.device
    # what this stage sends to the next one (and gets gradients of), when that differs from
    # what it receives (`shapes`): a T5 stage at the encoder/decoder split gets the encoder
    # output and sends (decoder hidden, encoder output); None: the same as `shapes`
    next_shapes: tuple[tuple[int, ...], ...] | None = None

    def empty(self, requires_grad: bool = False, shapes=None) -> Tensors:
        return tuple(torch.empty(s, dtype=self.dtype, device=self.device,
                                 requires_grad=requires_grad) for s in (shapes or self.shapes))


def communicate(spec: TensorSpec, *, send_next: Tensors | None = None,
                send_prev: Tensors | None = None, recv_prev: bool = False,
                recv_next: bool = False) -> tuple[Tensors | None, Tensors | None]:
    """One exchange step; returns (tensors from prev, tensors from next), None where not asked.

    Sent tensors are detached and cast to `spec.dtype`; received ones are fresh tensors.
    """
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return None, None
    group = ps.get_pipeline_model_parallel_group()
    nxt, prv = _peer(True), _peer(False)
    ops: list[dist.P2POp] = []
    keep = []  # contiguous send buffers must live until the ops complete

    def add_sends(tensors, peer, tag):
        for t in tensors:
            t = t.detach().to(spec.dtype).contiguous()
            keep.append(t)
            ops.append(dist.P2POp(dist.isend, t, peer, group=group, tag=tag))

    if send_next is not None:
        add_sends(send_next, nxt, FORWARD_TAG)
    if send_prev is not None:
        add_sends(send_prev, prv, BACKWARD_TAG)
    from_prev = spec.empty() if recv_prev else None
    from_next = spec.empty(shapes=spec.next_shapes) if recv_next else None
    for t in from_prev or ():
        ops.append(dist.P2POp(dist.irecv, t, prv, group=group, tag=FORWARD_TAG))
    for t in from_next or ():
        ops.append(dist.P2POp(dist.irecv, t, nxt, group=group, tag=BACKWARD_TAG))
    _run(ops, spec)
    return from_prev, from_next


def _run(ops: list, spec: TensorSpec) -> None:
    """Post `ops` as one batch and wait for them (a communication span of a profiled run)."""
    if ops:
        with _timeline.span("C") if _timeline is not None else contextlib.nullcontext():
            for req in collectives.batch_isend_irecv(ops):
                req.wait()
    if spec.device.type == "cuda":
        torch.cuda.synchronize()  # a received buffer is read right after (Megatron does this)


def _peer(to_next: bool) -> int:
    return ps.get_pipeline_model_parallel_next_rank() if to_next else \
        ps.get_pipeline_model_parallel_prev_rank()


def isend(spec: TensorSpec, tensors: Tensors, *, to_next: bool, gradient: bool | None = None,
          chunk: int = 0) -> list:
    """Post the sends of `tensors` to the next stage or the previous one and return without
    waiting: `(requests, buffers)` for `wait_sends`. `gradient` (default: `not to_next`)
    picks the tag: activations 0, gradients 1 (in a V placement chunk 1's activations go to
    the previous stage); `chunk` the group (`get_pipeline_model_parallel_group`). Schedules
    given as action tables (zero bubble) send this way and receive (`recv`) when an action
    needs its input, so a rank never waits on a send while its peer waits on it."""
    group = ps.get_pipeline_model_parallel_group(chunk)
    gradient = not to_next if gradient is None else gradient
    tag = BACKWARD_TAG if gradient else FORWARD_TAG
    keep = [t.detach().to(spec.dtype).contiguous() for t in tensors]
    ops = [dist.P2POp(dist.isend, t, _peer(to_next), group=group, tag=tag) for t in keep]
    return [collectives.batch_isend_irecv(ops), keep]


def recv(spec: TensorSpec, *, from_next: bool, gradient: bool | None = None,
         chunk: int = 0) -> Tensors:
    """Receive the tuple `isend` sent from the next or the previous stage (`gradient`, default
    `from_next`, and `chunk` as there); fresh tensors of `spec`'s shapes (`next_shapes`
    from the next stage)."""
    group = ps.get_pipeline_model_parallel_group(chunk)
    gradient = from_next if gradient is None else gradient
    tag = BACKWARD_TAG if gradient else FORWARD_TAG
    out = spec.empty(shapes=spec.next_shapes if from_next else None)
    _run([dist.P2POp(dist.irecv, t, _peer(from_next), group=group, tag=tag) for t in out], spec)
    return out


def wait_sends(pending: list, completed_only: bool = False) -> None:
    """Wait for the sends `isend` posted and drop them from `pending` (freeing their
    buffers); with `completed_only`, only those already complete (never blocks)."""
    keep = []
    for reqs, buffers in pending:
        if completed_only and not all(req.is_completed() for req in reqs):
            keep.append((reqs, buffers))
            continue
        for req in reqs:
            req.wait()
    pending[:] = keep


def recv_forward(spec: TensorSpec) -> Tensors | None:
    if ps.is_pipeline_first_stage():
        return None
    return communicate(spec, recv_prev=True)[0]


def send_forward(spec: TensorSpec, outputs: Tensors | None) -> None:
    if outputs is not None and not ps.is_pipeline_last_stage():
        communicate(spec, send_next=outputs)


def recv_backward(spec: TensorSpec) -> Tensors | None:
    if ps.is_pipeline_last_stage():
        return None
    return communicate(spec, recv_next=True)[1]


def send_backward(spec: TensorSpec, grads: Tensors | None) -> None:
    if grads is not None and not ps.is_pipeline_first_stage():
        communicate(spec, send_prev=grads)


def send_forward_recv_backward(spec: TensorSpec, outputs: Tensors | None) -> Tensors | None:
    if ps.is_pipeline_last_stage():
        return None
    return communicate(spec, send_next=outputs, recv_next=True)[1]


def send_backward_recv_forward(spec: TensorSpec, grads: Tensors | None) -> Tensors | None:
    if ps.is_pipeline_first_stage():
        return None
    return communicate(spec, send_prev=grads, recv_prev=True)[0]
